from tailtamer.model.config import ModelConfig
from tailtamer.model.transformer import KVCache, Transformer

__all__ = ["ModelConfig", "KVCache", "Transformer"]
