"""Everything that sends work to tokenq or reads its results. Torch-free."""
