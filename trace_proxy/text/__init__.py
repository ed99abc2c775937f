"""Text: token ids decoded (token2text), drift, tokenizers found, tool calls and conversations read
from decoded text."""
