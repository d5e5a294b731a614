"""The training loop and what it keeps: the run's setup (:mod:`~gigrl.training.build`), its
state (:mod:`~gigrl.training.state`), checkpoints, metrics files, held-out evaluation, and the
:class:`~gigrl.training.trainer.Trainer` that runs SFT then RL steps."""
