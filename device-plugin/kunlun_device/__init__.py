"""kunlun_device package."""
