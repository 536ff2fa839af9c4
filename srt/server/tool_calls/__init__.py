"""Tool calling and reasoning output on the OpenAI routes."""
