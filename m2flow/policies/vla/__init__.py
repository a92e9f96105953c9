"""Vision-language-action policies: OpenVLA's Prismatic design (vision backbone -> projector ->
causal LM) with action tokens, decoded autoregressively (OpenVLA) or in parallel as action
chunks (OpenVLA-OFT)."""
