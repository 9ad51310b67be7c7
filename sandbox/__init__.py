"""The CPU-node sandbox service: bubblewrap executor pools. Never imports torch or vLLM."""
