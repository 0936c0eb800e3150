"""Model math: pure functions over parameter pytrees."""
