"""Offline data for the harness: token files (text) and image arrays, sharded per rank."""
from .images import ImageData, ImageLoader, image_eval_batches, load_images
from .text import TokenLoader, decode_bytes, encode_bytes, ensure_prepared, eval_batches, prepare, read_meta

__all__ = ["ImageData", "ImageLoader", "TokenLoader", "decode_bytes", "encode_bytes", "ensure_prepared",
           "eval_batches", "image_eval_batches", "load_images", "prepare", "read_meta"]
