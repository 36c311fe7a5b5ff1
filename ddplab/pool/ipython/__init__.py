"""The pool's IPython side: what the kit needs from IPython, and what it adds to it.

- `cells`: the running shell, and how IPython names cells ("Cell In[4]"), which the ranks
  are told so that their tracebacks name cells as IPython does.
- `magics`: the `%%ranks` cell magic.

Nothing else in the pool imports IPython: outside IPython (a script, pytest) the pool works
without it.
"""
