"""The embedded default LLM: a tiny DeepSeek-V3 trained by our own script on offline text and recall tasks."""
