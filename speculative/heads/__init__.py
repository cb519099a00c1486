"""MTP heads: finding or fetching one (find), listing and pulling them (store), the head module (mtp),
its precision in memory (precision), and reading safetensors files (tensors)."""
