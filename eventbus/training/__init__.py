"""The training process: Composer's Trainer and State, the loop, and what it hands the bus."""
