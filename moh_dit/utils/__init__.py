"""Small shared tools: atomic writes and locks, output-folder checks, device settings,
the scripts' error handling, speed (peak FLOP/s, MFU, compile)."""
