"""Configuration loading in one place: command-line flags and ``--config`` files into an ``EngineConfig``.

``flags`` declares the engine's flags (shared by ``serve``, the offline commands and the tuner) and
turns parsed flags into the config; ``config_file`` reads the YAML/JSON file whose keys are flag names.
"""
