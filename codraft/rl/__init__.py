"""RL post-training: tasks and rewards, GRPO loss and advantages, the co-training step, the trainer loop."""
