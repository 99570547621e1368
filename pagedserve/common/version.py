"""The version every part of pagedserve reports."""
__version__ = "0.1.0"
