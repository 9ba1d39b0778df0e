"""``python -m codraft`` (and ``torchrun ... -m codraft train``): the ``codraft`` command."""
from codraft.cli import run

if __name__ == "__main__":
    run()
