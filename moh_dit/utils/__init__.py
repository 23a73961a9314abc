"""Developer helpers: speed (peak FLOP/s, MFU, compile) and figures."""
