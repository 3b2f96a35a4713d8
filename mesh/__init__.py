"""mesh package."""
