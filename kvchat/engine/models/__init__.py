"""Model loading: any mlx_lm.load folder or id, and the built-in demo models kvchat makes itself."""
