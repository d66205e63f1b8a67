"""The worker engine embedded in each inference worker."""
