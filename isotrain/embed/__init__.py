"""Contrastive embedding training whose negatives are the whole global batch, on any layout (`isotrain embed`).

pooling.py   hidden states -> one vector per text (mean, cls, last non-pad token)
loss.py      InfoNCE over the global batch: pure tensor functions
encode.py    texts -> pooled vectors in token-bounded chunks, dropout keyed per sample
gradcache.py one step: embed without gradient, gather, loss once, re-run with the cached gradients
data.py      {query, positive, negatives} rows -> tokenized samples
"""
