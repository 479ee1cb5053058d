"""Model architectures and their building blocks."""
