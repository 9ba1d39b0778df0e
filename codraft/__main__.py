"""``python -m codraft`` (and ``torchrun ... -m codraft train``): the ``codraft`` command."""
from codraft.cli import main

if __name__ == "__main__":
    main()
