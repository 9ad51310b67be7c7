"""Model-side formats shared by every role: the rStar2 chat format and the tiny CPU models."""
