"""edgetrain: train deep networks across clusters of low-cost edge devices."""
__version__ = "0.1.0"
