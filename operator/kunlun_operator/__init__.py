"""kunlun_operator package."""
