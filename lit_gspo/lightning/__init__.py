"""The Lightning adapter: ``RLModule`` (module.py) runs the RL core's step as Lightning's training step and its
validation as Lightning's validation loop; ``PromptDataModule`` (datamodule.py); the CLI (cli.py); strategies,
checkpoint IO, loggers, the progress bar, run directories, and callbacks/ (one job each)."""
