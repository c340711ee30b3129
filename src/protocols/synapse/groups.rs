//! Groups: named sets of agents — of any protocol — that a message with a `group_id`
//! reaches. Kept in the store and mirrored into the router's group table; in a fleet,
//! changed through the fleet's record of each group (`shared_groups`).

use tonic::Status;

use super::agents::{Hints, internal};
use super::db::{GroupRow, MemberRow};
use super::proto::{AgentEndpoint, CreateGroupRequest, GroupInfo, GroupMember};
use super::{Group, Synapse, translate::Context, wire};

impl Synapse {
    /// Agent `id`, named in a group by its id alone: an agent of any protocol the
    /// directory knows, or else a Synapse agent registered by that id, as `JoinGroup`
    /// registers the agent it names.
    async fn member_agent(&self, id: &str, field: &str) -> Result<(), Status> {
        if self.core.directory.contains(id) {
            return Ok(());
        }
        let endpoint = AgentEndpoint {
            agent_id: id.to_owned(),
            ..Default::default()
        };
        self.ensure_agent(&endpoint, &Hints::default(), field).await
    }

    pub fn group(&self, id: &str) -> Result<Group, Status> {
        if id.is_empty() {
            return Err(Status::invalid_argument("group_id is required"));
        }
        self.groups
            .get(id)
            .map(|g| g.clone())
            .ok_or_else(|| Status::not_found(format!("group '{id}' not found")))
    }

    pub fn group_info(&self, group: &Group) -> GroupInfo {
        GroupInfo {
            id: group.row.id.clone(),
            name: group.row.name.clone(),
            description: group.row.description.clone(),
            coordinator_id: group.row.coordinator_id.clone(),
            status: group.row.status.clone(),
            created_at: Some(wire::timestamp(group.row.created_at)),
        }
    }

    pub async fn create_group(
        &self,
        request: CreateGroupRequest,
        caller: Option<String>,
    ) -> Result<Group, Status> {
        if request.name.trim().is_empty() {
            return Err(Status::invalid_argument("name is required"));
        }
        let coordinator = Some(request.coordinator_id.clone())
            .filter(|c| !c.is_empty())
            .or(caller)
            .unwrap_or_default();
        // Bounded before any member is looked up.
        let max = self.config.max_group_members;
        if request.initial_members.len() > max {
            return Err(Status::resource_exhausted(format!(
                "initial_members: {} agents; a group holds at most {max}",
                request.initial_members.len()
            )));
        }
        let named = std::iter::once((&coordinator, "coordinator_id"))
            .filter(|(id, _)| !id.is_empty())
            .chain((request.initial_members.iter()).map(|m| (m, "initial_members")));
        // Every one checked before any is registered, so that a refusal registers none.
        let unknown: Vec<(&String, &str)> = named
            .filter(|(id, _)| !self.core.directory.contains(id))
            .collect();
        for (id, field) in &unknown {
            self.may_register(id.trim(), field)?;
        }
        for (id, field) in unknown {
            self.member_agent(id, field).await?;
        }
        let now = crate::core::now_ms();
        let mut members: Vec<MemberRow> = Vec::new();
        if !coordinator.is_empty() {
            members.push(MemberRow {
                agent_id: coordinator.clone(),
                role: "coordinator".into(),
                joined_at: now,
            });
        }
        let mut seen: foldhash::HashSet<&str> = std::iter::once(&*coordinator).collect();
        for member in &request.initial_members {
            if seen.insert(member) {
                members.push(MemberRow {
                    agent_id: member.clone(),
                    role: "member".into(),
                    joined_at: now,
                });
            }
        }
        let row = GroupRow {
            id: uuid::Uuid::new_v4().to_string(),
            name: request.name.clone(),
            description: request.description.clone(),
            coordinator_id: coordinator,
            status: "active".into(),
            created_at: now,
        };
        let group = Group { row, members };
        if let Some(records) = self.core.records() {
            self.create_shared_group(records.as_ref(), &group).await?;
            return Ok(group);
        }
        // Kept in memory in the poll that queues its row, which a caller gone after does
        // not stop (`Store::write`): the two never disagree. Taken back if the write fails.
        self.keep_group(group.clone());
        let written = (self.db).insert_group(group.row.clone(), group.members.clone());
        if let Err(e) = written.await {
            self.forget_group(&group.row.id);
            return Err(internal(e));
        }
        Ok(group)
    }

    /// Adds an agent to a group: any known agent, or a new Synapse agent described by `agent`.
    pub async fn join_group(
        &self,
        group_id: &str,
        agent: &AgentEndpoint,
        hints: &Hints,
    ) -> Result<(), Status> {
        let records = self.core.records();
        if records.is_none() {
            self.group(group_id)?;
        } else if group_id.is_empty() {
            return Err(Status::invalid_argument("group_id is required"));
        }
        if agent.agent_id.is_empty() {
            return Err(Status::invalid_argument("agent.agent_id is required"));
        }
        if !self.core.directory.contains(&agent.agent_id) {
            self.ensure_agent(agent, hints, "agent").await?;
        }
        let member = MemberRow {
            agent_id: agent.agent_id.clone(),
            role: "member".into(),
            joined_at: crate::core::now_ms(),
        };
        let max = self.config.max_group_members;
        let join = |group: &mut Group| joining(group, member.clone(), max);
        if let Some(records) = records {
            return self
                .change_shared_group(records.as_ref(), group_id, join)
                .await;
        }
        join(&mut self.group(group_id)?)?;
        // In memory as its row's write is queued, as a group is created.
        self.update_group(group_id, |g| g.members.push(member.clone()));
        let written = self.db.set_membership(group_id, member.clone(), true);
        if let Err(e) = written.await {
            let id = member.agent_id;
            self.update_group(group_id, |g| g.members.retain(|m| m.agent_id != id));
            return Err(internal(e));
        }
        Ok(())
    }

    pub async fn leave_group(&self, group_id: &str, agent_id: &str) -> Result<(), Status> {
        let records = self.core.records();
        if records.is_none() {
            self.group(group_id)?;
        } else if group_id.is_empty() {
            return Err(Status::invalid_argument("group_id is required"));
        }
        if agent_id.is_empty() {
            return Err(Status::invalid_argument("agent_id is required"));
        }
        let leave = |group: &mut Group| leaving(group, agent_id);
        if let Some(records) = records {
            return self
                .change_shared_group(records.as_ref(), group_id, leave)
                .await
                .map(drop);
        }
        let member = leave(&mut self.group(group_id)?)?;
        // In memory as its row's write is queued, as a group is created.
        self.update_group(group_id, |g| g.members.retain(|m| m.agent_id != agent_id));
        let written = self.db.set_membership(group_id, member.clone(), false);
        if let Err(e) = written.await {
            self.update_group(group_id, |g| g.members.push(member));
            return Err(internal(e));
        }
        Ok(())
    }

    pub async fn disband_group(&self, group_id: &str) -> Result<(), Status> {
        if let Some(records) = self.core.records() {
            if group_id.is_empty() {
                return Err(Status::invalid_argument("group_id is required"));
            }
            return self.remove_shared_group(records.as_ref(), group_id).await;
        }
        let group = self.group(group_id)?;
        // Gone from memory as its row's delete is queued, as a group is created.
        self.forget_group(group_id);
        if let Err(e) = self.db.delete_group(group_id).await {
            self.keep_group(group);
            return Err(internal(e));
        }
        Ok(())
    }

    /// Puts `group` in the group map and the router.
    pub(super) fn keep_group(&self, group: Group) {
        self.sync_group(&group);
        self.groups.insert(group.row.id.clone(), group);
    }

    /// Drops group `id` from the group map and the router.
    pub(super) fn forget_group(&self, id: &str) {
        self.groups.remove(id);
        self.core.router.remove_group(id);
    }

    pub fn group_members(&self, group: &Group) -> Vec<GroupMember> {
        group
            .members
            .iter()
            .map(|m| {
                let endpoint = self.endpoint_of(&m.agent_id);
                let online = self
                    .core
                    .directory
                    .get(&m.agent_id)
                    .is_some_and(|a| a.online);
                GroupMember {
                    agent_id: m.agent_id.clone(),
                    agent_name: endpoint.agent_name,
                    role: m.role.clone(),
                    status: if online { "online" } else { "offline" }.into(),
                    joined_at: Some(wire::timestamp(m.joined_at)),
                }
            })
            .collect()
    }

    pub fn is_member(&self, group_id: &str, agent_id: &str) -> bool {
        self.groups
            .get(group_id)
            .is_some_and(|g| g.members.iter().any(|m| m.agent_id == agent_id))
    }

    fn update_group(&self, group_id: &str, change: impl FnOnce(&mut Group)) {
        if let Some(mut group) = self.groups.get_mut(group_id) {
            change(&mut group);
            self.sync_group(&group);
        }
    }

    pub(super) fn sync_group(&self, group: &Group) {
        self.core.router.set_group(
            &group.row.id,
            group.members.iter().map(|m| m.agent_id.clone()).collect(),
        );
    }
}

/// Adds `member` to `group`, if it has room and does not have it already.
fn joining(group: &mut Group, member: MemberRow, max: usize) -> Result<(), Status> {
    let id = &group.row.id;
    if group.members.len() >= max {
        return Err(Status::resource_exhausted(format!(
            "group '{id}' holds its most members, {max}"
        )));
    }
    if group.members.iter().any(|m| m.agent_id == member.agent_id) {
        return Err(Status::already_exists(format!(
            "agent '{}' is already a member of group '{id}'",
            member.agent_id
        )));
    }
    group.members.push(member);
    Ok(())
}

/// Takes `agent_id` out of `group`: the member it was.
fn leaving(group: &mut Group, agent_id: &str) -> Result<MemberRow, Status> {
    let Some(at) = group.members.iter().position(|m| m.agent_id == agent_id) else {
        return Err(Status::failed_precondition(format!(
            "agent '{agent_id}' is not a member of group '{}'",
            group.row.id
        )));
    };
    Ok(group.members.remove(at))
}
