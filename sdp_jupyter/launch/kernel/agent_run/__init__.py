"""The agent run: the run every target but SageMaker shares, local included (run.py's `AgentRun`). One
agent per node (launch/host/agent.py) over a link (link.py); what the run mirrors into the job directory
(mirror.py); its session, --heal and rank-request channels to the agents (session_channel.py,
heal_channel.py, rank_requests.py). A target's launcher (launch/targets/NAME/launcher.py) subclasses
`AgentRun` and `Link`; elastic membership (launch/kernel/elastic.py) speaks to it through the door
`elastic.ElasticRun` names, and to nothing else of it.
"""
