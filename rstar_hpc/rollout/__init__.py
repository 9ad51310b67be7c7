"""The rollout role: vLLM engine ranks and the agent loop."""
