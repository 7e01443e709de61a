//! Messages published and not yet answered, by delivery tag: what one
//! confirm (single or `multiple`), nack or return settles.

use super::SinkError;
use super::wire::Event;
use super::wire::Returned;
use super::wire::WireError;
use crate::logtext::shown;
use std::collections::VecDeque;

/// Messages published and not yet answered, by delivery tag, oldest first.
/// Tags are consecutive from 1 on a new connection; the broker may answer
/// out of order (e.g. messages routed to different queues), singly or for
/// every tag up to one (`multiple`).
#[derive(Debug)]
pub struct Unconfirmed<T> {
    first_tag: u64,
    slots: VecDeque<Option<Slot<T>>>,
    live: usize,
}

#[derive(Debug)]
struct Slot<T> {
    item: T,
    returned: Option<Box<Returned>>,
}

impl<T> Default for Unconfirmed<T> {
    fn default() -> Self {
        Unconfirmed {
            first_tag: 1,
            slots: VecDeque::new(),
            live: 0,
        }
    }
}

impl<T> Unconfirmed<T> {
    /// `item` was published as `tag` (tags come in increasing order).
    pub fn push(&mut self, tag: u64, item: T) {
        while self.first_tag + (self.slots.len() as u64) < tag {
            self.slots.push_back(None);
        }
        self.slots.push_back(Some(Slot {
            item,
            returned: None,
        }));
        self.live += 1;
    }

    /// Every waiting message, oldest first, and the list empty, its tags
    /// from 1 again: the channel they were published on is gone.
    pub fn take_all(&mut self) -> Vec<T> {
        let items = self.slots.drain(..).flatten().map(|s| s.item).collect();
        self.first_tag = 1;
        self.live = 0;
        items
    }

    /// Messages waiting for an answer.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Tags from the oldest waiting message to the newest: what the list
    /// holds (one entry per tag), however few of them still wait.
    pub fn span(&self) -> usize {
        self.slots.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Every waiting message, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().flatten().map(|s| &s.item)
    }

    /// The message that has waited longest.
    pub fn oldest(&self) -> Option<&T> {
        self.slots.iter().flatten().next().map(|s| &s.item)
    }

    /// Applies a broker answer: the messages it settles go to `out` in tag
    /// order, with their outcome. `message_id` gives a message's
    /// `message_id` property as published and `destination` its exchange
    /// and routing key: a returned message is known by them (errors name
    /// it).
    pub fn apply(
        &mut self,
        ev: Event,
        message_id: impl Fn(&T) -> Option<String>,
        destination: impl Fn(&T) -> (String, String),
        out: &mut Vec<(T, Result<(), SinkError>)>,
    ) -> Result<(), SinkError> {
        let protocol = |what: String| SinkError::Amqp {
            what: "reading the broker's answers",
            url: String::from("broker connection"),
            source: WireError::Protocol(what),
        };
        match ev {
            Event::Blocked(_) | Event::Drained | Event::Exchange { .. } => Ok(()),
            Event::Returned(ret) => {
                // A return carries no delivery tag: its message is known by
                // message_id (and, among copies, by destination). Ids are
                // meant to be unique, but nothing enforces it, and copies
                // to the same destination may be routed differently
                // (headers exchanges, CC/BCC, a binding removed between
                // them): so the return marks the one candidate when there
                // is one, else every candidate with its destination, else
                // every one with its id. A copy that was routed is then
                // published again (a duplicate), never one that was
                // returned counted as delivered.
                let dest = (ret.exchange.clone(), ret.routing_key.clone());
                let mut candidates = Vec::new();
                let mut seen = false;
                for (i, s) in self.slots.iter().enumerate() {
                    let Some(s) = s else { continue };
                    if message_id(&s.item) != ret.message_id {
                        continue;
                    }
                    seen = true;
                    if s.returned.is_none() {
                        candidates.push(i);
                    }
                }
                if candidates.len() > 1 {
                    let same_dest: Vec<usize> = candidates
                        .iter()
                        .copied()
                        .filter(|&i| {
                            self.slots[i]
                                .as_ref()
                                .is_some_and(|s| destination(&s.item) == dest)
                        })
                        .collect();
                    if !same_dest.is_empty() {
                        candidates = same_dest;
                    }
                }
                for &i in &candidates {
                    if let Some(s) = self.slots[i].as_mut() {
                        s.returned = Some(Box::new(ret.clone()));
                    }
                }
                if candidates.is_empty() && !seen {
                    return Err(protocol(format!(
                        "basic.return for a message not waiting for a confirm (message_id {:?})",
                        ret.message_id
                    )));
                }
                Ok(())
            }
            Event::Ack { tag, multiple } | Event::Nack { tag, multiple } => {
                let acked = matches!(ev, Event::Ack { .. });
                let end = self.first_tag + self.slots.len() as u64;
                let last = if tag == 0 && multiple { end - 1 } else { tag };
                if last >= end {
                    return Err(protocol(format!(
                        "basic.ack/nack for delivery tag {tag}, but only {} were published",
                        end - 1
                    )));
                }
                if last < self.first_tag {
                    return Ok(()); // already answered
                }
                let upto = (last - self.first_tag) as usize + 1;
                let from = if multiple { 0 } else { upto.saturating_sub(1) };
                for slot in self.slots.range_mut(from..upto) {
                    if let Some(Slot { item, returned }) = slot.take() {
                        self.live -= 1;
                        let res = match returned {
                            Some(r) => Err(SinkError::Returned {
                                id: r.message_id.as_deref().map_or_else(|| "?".into(), shown),
                                exchange: r.exchange,
                                routing_key: r.routing_key,
                                reply: r.reply_text,
                            }),
                            None if acked => Ok(()),
                            None => Err(SinkError::Nacked {
                                id: message_id(&item)
                                    .as_deref()
                                    .map_or_else(|| "?".into(), shown),
                            }),
                        };
                        out.push((item, res));
                    }
                }
                while matches!(self.slots.front(), Some(None)) {
                    self.slots.pop_front();
                    self.first_tag += 1;
                }
                Ok(())
            }
        }
    }
}
