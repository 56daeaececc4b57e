"""Small helpers that several layers share: logging set-up, compile counting, text for prompts."""
