"""The cw_lens version (part of the main job's state fingerprint: bump it when results change)."""

__version__ = "0.5.0"
