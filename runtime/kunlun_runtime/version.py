"""The project version, read from the installed distribution."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kunlun-inference")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"
