"""CUDA tests (marked ``cuda``): run only where ``torch.cuda.is_available()``, skipped elsewhere."""
