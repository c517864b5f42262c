"""Anthropic's Messages API (`/v1/messages`) on the chat endpoint's machinery."""
