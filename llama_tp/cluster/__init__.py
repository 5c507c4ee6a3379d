"""Rank-aware helpers shared by every layer: printing and collectives, the watchdog,
BLAS detection, the doctor's checks, the launcher. Imports nothing else of llama_tp."""
