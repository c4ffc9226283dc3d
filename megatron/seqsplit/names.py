"""The names the command line offers for attention kernels and KV-cache layouts, in a
module without torch: the trainer checks its flags before importing torch."""

BACKEND_NAMES = ("sdpa", "flash", "flex")
KV_CACHE_LAYOUTS = ("buffer", "chunked")
