"""The training harness behind ``lioncub train``: models, offline data, the
training loop, metrics, checkpoints and plots.

Kept out of the library core (``import lioncub`` never imports it). Python entry:
``lioncub.harness.train.run(TrainConfig(...)) -> summary dict``.
"""
from .config import TrainConfig

__all__ = ["TrainConfig"]
