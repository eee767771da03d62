"""A cache-aware router: one OpenAI endpoint in front of several engine replicas (`kvforge router`,
`kvforge serve --data-parallel-size N`), sending each request where its prompt's prefix was sent before."""
