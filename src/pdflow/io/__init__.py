"""The async I/O shell around the pure core: HTTP bootstrap, control channel, timers, settings.

Import the submodules you need (``pdflow.io.bootstrap_server``, ``pdflow.io.settings``, ...);
this package imports nothing itself, so a light command does not pay for the heavy ones.
"""
