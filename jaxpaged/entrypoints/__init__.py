"""What users call: the offline LLM class, the generate and serve command lines, the OpenAI-compatible server."""
