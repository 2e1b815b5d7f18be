"""isotrain: train and post-train language models with the same math whatever the layout."""

__version__ = "0.1.0"
