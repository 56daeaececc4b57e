"""The engines: LLMEngine's step (schedule, execute, update), AsyncLLMEngine's loop, beam search and detokenizing."""
