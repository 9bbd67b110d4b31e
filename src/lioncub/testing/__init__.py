"""Tools for testing Lion Cub itself: the device audit and the optimizer paths it runs."""
