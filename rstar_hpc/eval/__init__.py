"""Evaluation: a policy measured the way the paper does (avg@k pass@1 with k samples per problem, the same agent
loop, tool and reward as training). metrics.py holds the figures."""
