"""Publishing trained drafts to the Hugging Face Hub: a model card (card.py) and a bounded-retry push (push.py)."""
