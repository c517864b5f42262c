"""Quantization methods: how a layer's weights are stored, loaded and multiplied (base.py), one
module per checkpoint format (fp8.py, compressed_int.py, gptq.py; the integer ones share
integer.py), found by the format's name in registry.py."""
