"""Offline quantizers behind `kvforge quantize`: calibration statistics, GPTQ, AWQ, SmoothQuant and the
checkpoint writer. They produce the formats that kvforge.quantization runs."""
