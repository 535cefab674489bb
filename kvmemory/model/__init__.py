"""Loading models and describing what determines their KV bytes."""

from kvmemory.model.fingerprint import KVGeometry, fingerprint, geometry
from kvmemory.model.loader import DEFAULT_MODEL_NAME, default_model_dir, load_model

__all__ = ["DEFAULT_MODEL_NAME", "KVGeometry", "default_model_dir", "fingerprint", "geometry", "load_model"]
