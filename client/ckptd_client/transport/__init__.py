"""Staging transports: where a rank's staged bytes go (in-process writer, or the daemon)."""
