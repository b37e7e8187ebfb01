"""fishgate's model layer: Fish Speech 1.5 (DualAR text→semantic transformer, firefly-gan-vq codec) in PyTorch.

Pure PyTorch: no asyncio, no environment reads, no work at import time. The engine in `streaming/` is the only
package that imports this one.
"""
