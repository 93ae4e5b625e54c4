"""Hugging Face interop: load safetensors weights into a set-up model, export a model as safetensors."""

from minifabric.checkpoint.hf.export import export_module, export_safetensors
from minifabric.checkpoint.hf.files import is_safetensors
from minifabric.checkpoint.hf.load import KeyMap, load_safetensors
from minifabric.checkpoint.ties import tied_groups

__all__ = [
    "KeyMap",
    "export_module",
    "export_safetensors",
    "is_safetensors",
    "load_safetensors",
    "tied_groups",
]
