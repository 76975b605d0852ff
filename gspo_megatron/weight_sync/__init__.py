"""weight_sync package."""
