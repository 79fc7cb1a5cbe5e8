"""tailtamer: reasoning RL with lossless, adaptive speculative decoding for the long rollout tail."""

__version__ = "0.1.0"
